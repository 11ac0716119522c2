"""The shared core, a leaf both peers import: the wire protocol (``protocol``), the model
runtime (``models``, ``kv_cache``), processed distributions and keyed random numbers
(``sampling``), lossless verification (``rejection``), detokenisation (``detok``), a request's
state (``sequence``) and the speculative loop written against the peers' interfaces (``loop``).
Imports torch and transformers only: no Ray, FastAPI, pydantic or vLLM."""
