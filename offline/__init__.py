"""In-process tools above the two peers: they compose a drafter and a verifier in one process,
with no Ray. The reference CLI (``offline.generate``) and the training pipelines (``offline.training``)."""
