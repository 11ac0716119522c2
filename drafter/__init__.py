"""Draft proposers (model drafter, n-gram lookup) and drafter training."""
