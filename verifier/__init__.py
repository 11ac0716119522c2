"""Target-model engines that verify drafts: transformers (``engine``) and vLLM (``vllm_engine``)."""
