"""Draft proposers served by the drafter pool: the model drafter and n-gram lookup."""
