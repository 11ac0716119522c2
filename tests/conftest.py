import os

import pytest
import torch

# Tests share two cores with each other and with Ray; keep torch from oversubscribing them.
torch.set_num_threads(int(os.environ.get("SPLITSPEC_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_pair():
    """(tokenizer, peaked target, drafter that agrees often but not always)."""
    from tests.helpers import noisy_copy, tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    target = tiny_llama(len(tok), peak=30.0, eos_token_id=None)
    return tok, target, noisy_copy(target, 0.15)
