"""The engines' decoder forward (core.llama) and paged cache (core.kv_cache) against the models'
own transformers modules: same logits, same captured hidden states, bf16 greedy up to near-ties."""

import copy
from pathlib import Path

import pytest
import torch

from core.kv_cache import PagedKVCache, batched_forward
from core.llama import CompactLlama, HFRunner, NativeLlama, compact_unsupported, make_runner
from core.models import cpu_has_fast_bf16, resolve_dtype, resolve_kv_dtype
from core.native import load as load_native
from core.native import why_unavailable
from core.protocol import prefix_hash


def native_ops():
    """The native forward's ops; a test of it fails (not skips) where it cannot be built, unless
    SPLITSPEC_NATIVE=0 says so: CI has a compiler, and a silently skipped kernel would rot."""
    ops = load_native()
    if ops is None:
        if why_unavailable() == "SPLITSPEC_NATIVE=0":
            pytest.skip("SPLITSPEC_NATIVE=0")
        pytest.fail(f"the native forward did not build: {why_unavailable()}")
    return ops


def tiny(kind: str, seed: int = 0):
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    if kind == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=None)).eval()
    if kind == "qwen2":  # q/k/v biases
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, use_sliding_window=False)).eval()
    if kind == "qwen3":  # per-head q/k RMSNorm
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16)).eval()
    raise ValueError(kind)


def run_steps(runner, model, feeds, capture=()):
    """Two batched passes over three sequences (a prefill of different lengths, then 1-3 new
    tokens each, so rows are padded): the logits of every new token, per pass."""
    cache = PagedKVCache(model.config, 128, 8 * 2**20, torch.float32)
    slots = []
    for i in range(len(feeds[0])):
        slots.append(cache.claim(f"s{i}", 0, None, feeds[0][i] + [0], set()))
    out = []
    for feed in feeds:
        for i, toks in enumerate(feed):
            cache.reserve(f"s{i}", len(slots[i].tokens) + len(toks), set())
        out.append(batched_forward(runner, cache, slots, feed, [len(t) for t in feed], capture))
    return out


FEEDS = [[[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]],
         [[40], [41, 42, 43], [44, 45]]]


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_compact_forward_equals_the_models_modules(kind):
    model = tiny(kind)
    assert compact_unsupported(model, 128) is None
    compact = run_steps(CompactLlama(model, 128), model, FEEDS)
    hf = run_steps(HFRunner(model), model, FEEDS)
    for step_c, step_h in zip(compact, hf):
        for c, h in zip(step_c, step_h):
            torch.testing.assert_close(c, h, atol=2e-5, rtol=1e-4)
    # and against one uncached pass over each whole sequence
    for i in range(3):
        ids = torch.tensor([FEEDS[0][i] + FEEDS[1][i]])
        with torch.inference_mode():
            full = model(input_ids=ids).logits[0]
        torch.testing.assert_close(compact[1][i], full[-len(FEEDS[1][i]):], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "qwen3"])
def test_native_forward_equals_the_models_modules(kind):
    """core/csrc/decoder.cpp in float32, batched and padded, with captured states: the modules'
    logits up to the order of a sum (its RMSNorm reduces in its own order)."""
    model = tiny(kind)
    capture = (0, 2, 3)  # 3: the stream after the last layer (before the final norm: the compact forward's)
    native = run_steps(NativeLlama(model, 128, native_ops()), model, FEEDS, capture)
    hf = run_steps(HFRunner(model), model, FEEDS)
    compact = run_steps(CompactLlama(model, 128), model, FEEDS, capture)
    for (logits_n, states_n), logits_h, (_, states_c) in zip(native, hf, compact):
        for n, h in zip(logits_n, logits_h):
            torch.testing.assert_close(n, h, atol=2e-5, rtol=1e-4)
        for sn, sc in zip(states_n, states_c):
            assert sorted(sn) == list(capture)
            for L in capture:
                torch.testing.assert_close(sn[L], sc[L], atol=2e-5, rtol=1e-4)


def test_native_bf16_forward_rounds_as_the_eager_one():
    """bf16: every elementwise step rounds where the eager compact forward's ops do, so the logits
    agree to a few bf16 steps (an RMSNorm sum in another order flips a rounding now and then) and
    the greedy token is the same wherever the top two are not within that distance."""
    model = tiny("qwen3").to(torch.bfloat16)
    ops = native_ops()
    for feeds in (FEEDS, [[[3 + (7 * i) % 90 for i in range(60)], [9] * 5, [11, 12]], [[50], [51, 52], [53]]]):
        native = run_steps(NativeLlama(model, 128, ops), model, feeds)
        eager = run_steps(CompactLlama(model, 128), model, feeds)
        for step_n, step_e in zip(native, eager):
            for n, e in zip(step_n, step_e):
                assert (n - e).abs().max() <= 4 * 2 ** -7 * max(1.0, float(e.abs().max()))
                top2 = e.topk(2, dim=-1).values
                clear = (top2[:, 0] - top2[:, 1]) > 0.125
                assert torch.equal(n.argmax(-1)[clear], e.argmax(-1)[clear])


def assert_one_rounding(y, x, w, bias):
    """y (bf16) is x . w^T + bias summed in float32 and rounded once: within one bf16 step of the float64
    result, plus what a float32 sum of K terms may lose (where terms cancel, more than a bf16 step of a
    small result)."""
    exact = x.double() @ w.double().T + (bias.double() if bias.numel() else 0)  # [T, out]
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(1e-30))) - 7)
    f32_sum = x.shape[1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T + 1)
    assert ((y.double() - exact).abs() <= ulp + f32_sum).all()


def biased_bf16_qwen2():
    """A tiny bf16 qwen2 with random q/k/v biases (zero at initialisation), so a kernel's bias path counts."""
    model = tiny("qwen2")
    g = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias.data = torch.randn(proj.bias.shape, generator=g)
    return model.to(torch.bfloat16)


def assert_same_up_to_a_rounding(runner_a, runner_b, model, feed_sets):
    """Two bf16 forwards that differ in the order of float32 sums: logits within two bf16 steps, the same
    greedy token wherever the top two are apart."""
    for feeds in feed_sets:
        for step_a, step_b in zip(run_steps(runner_a, model, feeds), run_steps(runner_b, model, feeds)):
            for a, b in zip(step_a, step_b):
                assert (a - b).abs().max() <= 2 * 2 ** -7 * max(1.0, float(b.abs().max()))
                top2 = b.topk(2, dim=-1).values
                clear = (top2[:, 0] - top2[:, 1]) > 0.0625
                assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_native_attention_equals_atens():
    """The native forward's own attention (the cache read in place, queries in registers) against ATen's
    scaled_dot_product_attention in the same forward, over head sizes that take every path (16 and 64: whole
    vectors, blocks of queries and single ones; 24: plain loops; 128), GQA groups of 1, 2 and 4, a prefill,
    decode steps, verification-sized steps of 3-9 tokens and padded batches (rows of the paged cache). A float32
    model and cache: logits equal to float32 rounding. bf16 (model and cache): within two bf16 steps, as two
    orders of float32 sums rounded to bf16 are."""
    import transformers

    ops = native_ops()
    for head_dim, heads, kv_heads in ((16, 4, 2), (64, 4, 4), (24, 4, 1), (128, 2, 2), (64, 8, 2)):
        torch.manual_seed(head_dim + kv_heads)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=256)).eval()
        for dtype in (torch.float32, torch.bfloat16):
            model = model.to(dtype)
            own, aten = NativeLlama(model, 256, ops), NativeLlama(model, 256, ops)
            aten.aten_attention = True
            one = [[[3 + (5 * i) % 90 for i in range(40)]], [[7]], [[8, 9, 10]], [[11] * 6], [[12] * 9], [[13]]]
            for feeds in (one, FEEDS):
                outs = []
                for runner in (own, aten):
                    cache = PagedKVCache(model.config, 256, 8 * 2**20, dtype)
                    slots = [cache.claim(f"s{i}", 0, None, [0], set()) for i in range(len(feeds[0]))]
                    steps = []
                    for feed in feeds:
                        for i, toks in enumerate(feed):
                            cache.reserve(f"s{i}", len(slots[i].tokens) + len(toks), set())
                        steps.append(batched_forward(runner, cache, slots, feed, [len(t) for t in feed]))
                    outs.append(steps)
                for step_own, step_aten in zip(*outs):
                    for a, b in zip(step_own, step_aten):
                        if dtype == torch.float32:
                            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
                        else:
                            assert (a - b).abs().max() <= 2 * 2 ** -7 * max(1.0, float(b.abs().max()))


def gemv_ops():
    """The native ops where this CPU runs the bf16 GEMV (AVX-512 BF16); a skip elsewhere."""
    from core.models import cpu_flags

    ops = native_ops()
    if not {"avx512f", "avx512bw", "avx512_bf16"} <= cpu_flags():
        pytest.skip("no AVX-512 BF16 on this CPU: the GEMV does not run here")
    assert ops.gemv_supported(), "the CPU has AVX-512 BF16 but the native GEMV says it does not"
    return ops


def test_gemv_is_the_float32_sum_rounded_once():
    """The native bf16 GEMV (one-token matmuls over the model's own weights): products exact in float32,
    summed in float32 with the bias, rounded once, so within one bf16 rounding of the float64 result;
    weights given in parts (q, k, v) land side by side as one fused output. Odd widths exercise the masked
    tails, 13 + 5 rows a short last block, up to 8 input rows the multi-row path."""
    ops = gemv_ops()
    g = torch.Generator().manual_seed(0)
    for rows, width in (((8,), 32), ((13, 5), 70), ((512, 128, 128), 512), ((3,), 1), ((100, 28), 1408)):
        parts = [torch.randn(r, width, generator=g).bfloat16() for r in rows]
        w = torch.cat(parts)
        for T in (1, 2, 5, 8):
            x = torch.randn(T, width, generator=g).bfloat16()
            for bias in (torch.randn(w.shape[0], generator=g).bfloat16(), torch.empty(0, dtype=torch.bfloat16)):
                y = ops.gemv(x, parts, bias)
                assert y.shape == (T, w.shape[0]) and y.dtype == torch.bfloat16
                assert_one_rounding(y, x, w, bias)
    with pytest.raises(RuntimeError, match="bias of 8"):  # a bias that does not fit is refused, not read past
        ops.gemv(torch.zeros(1, 32, dtype=torch.bfloat16), [torch.zeros(8, 32, dtype=torch.bfloat16)],
                 torch.zeros(4, dtype=torch.bfloat16))


def test_native_bf16_forward_with_the_gemv_as_without_it():
    """The forward with its one-token matmuls on the GEMV (batch 1 decoding, the drafter's steps) against
    the same forward on oneDNN's kernels: the same logits up to a flipped rounding, the same greedy token
    wherever the top two are apart. The engines pick it by themselves where the CPU has it."""
    ops = gemv_ops()
    model = biased_bf16_qwen2()
    with_gemv, without = NativeLlama(model, 128, ops), NativeLlama(model, 128, ops)
    without.parts = []
    assert with_gemv.gemv and len(with_gemv.parts) == 7 * 3 + 1
    one_token = [[[5, 6, 7, 8, 9, 10, 11]], [[40]], [[41]], [[42]]]  # a prefill, then batch-1 decode steps
    assert_same_up_to_a_rounding(with_gemv, without, model, (one_token, FEEDS))


def fma_ops():
    """The native ops where the build has FMA vectors (x86-64-v3 and up); a skip elsewhere."""
    from core.models import cpu_flags

    ops = native_ops()
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("no AVX2 + FMA on this CPU: the float32 FMA kernel does not run here")
    assert ops.fma_supported(), "the CPU has AVX2 and FMA but the native FMA kernel says it does not"
    return ops


def test_fma_linear_is_the_float32_sum_and_the_same_at_every_width():
    """The float32 few-row kernel: within a float32 sum's error of the float64 result, weights given in parts
    landing side by side, the bias added; odd widths exercise the tails, 13 + 5 rows short last blocks, 1-24 input
    rows every row-chunk shape. And each output row is bit-identical to the same row computed alone: a token's
    logits do not depend on how many drafts or sequences share its pass."""
    ops = fma_ops()
    g = torch.Generator().manual_seed(0)
    for rows, width in (((8,), 32), ((13, 5), 70), ((512, 128, 128), 512), ((3,), 1), ((100, 28), 1408), ((7,), 23)):
        parts = [torch.randn(r, width, generator=g) for r in rows]
        w = torch.cat(parts)
        for T in (1, 2, 3, 4, 5, 8, 9, 17, 24):
            x = torch.randn(T, width, generator=g)
            for bias in (torch.randn(w.shape[0], generator=g), torch.empty(0)):
                y = ops.fma_linear(x, parts, bias)
                assert y.shape == (T, w.shape[0]) and y.dtype == torch.float32
                exact = x.double() @ w.double().T + (bias.double() if bias.numel() else 0)
                bound = (width + 2) * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T
                                                    + bias.double().abs().sum() + 1)
                assert ((y.double() - exact).abs() <= bound).all()
                for t in {0, T // 2, T - 1}:
                    assert torch.equal(ops.fma_linear(x[t:t + 1], parts, bias)[0], y[t])
    with pytest.raises(RuntimeError, match="bias of 8"):
        ops.fma_linear(torch.zeros(1, 32), [torch.zeros(8, 32)], torch.zeros(4))
    with pytest.raises(RuntimeError, match="all float32 or all bf16"):
        ops.fma_linear(torch.zeros(1, 32), [torch.zeros(8, 16)], torch.empty(0))
    with pytest.raises(RuntimeError, match="all float32 or all bf16"):
        ops.fma_linear(torch.zeros(1, 32), [torch.zeros(8, 32), torch.zeros(8, 32, dtype=torch.bfloat16)],
                       torch.empty(0))


def test_fma_linear_reads_bf16_weights_as_the_float32_values_they_are():
    """Weights stored in bf16 (float32 weights that are all bf16 values): the same outputs, bit for bit, as the
    float32 weights give, at every row count and shape the kernel splits differently."""
    ops = fma_ops()
    g = torch.Generator().manual_seed(2)
    for rows, width in (((8,), 32), ((13, 5), 70), ((512, 128), 512), ((3,), 1), ((100, 28), 1408), ((7,), 23)):
        parts = [torch.randn(r, width, generator=g).bfloat16().float() for r in rows]
        halves = [w.bfloat16() for w in parts]
        for T in (1, 2, 3, 4, 5, 8, 9, 17, 64):
            x = torch.randn(T, width, generator=g)
            for bias in (torch.randn(sum(rows), generator=g), torch.empty(0)):
                assert torch.equal(ops.fma_linear(x, halves, bias), ops.fma_linear(x, parts, bias))


def test_native_float32_forward_with_the_fma_kernel_as_without_it():
    """float32: the forward with its matmuls of up to 64 rows on the FMA kernel against the same forward on
    the library's (at::linear): logits equal to float32 precision, the same greedy token wherever the top
    two are apart; a prefill past 64 rows goes to the library. The engines pick it by themselves."""
    ops = fma_ops()
    model = tiny("qwen2")
    g = torch.Generator().manual_seed(1)
    for layer in model.model.layers:  # (biases are zero at initialisation: make the bias path count)
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias.data = torch.randn(proj.bias.shape, generator=g)
    with_fma, without = NativeLlama(model, 128, ops), NativeLlama(model, 128, ops)
    without.parts = []
    assert with_fma.gemv and len(with_fma.parts) == 7 * 3 + 1
    one_token = [[[5, 6, 7, 8, 9, 10, 11]], [[40]], [[41]], [[42, 43, 44, 45, 46]]]
    long_prefill = [[[3 + (7 * i) % 90 for i in range(70)]], [[50, 51, 52]]]
    for feeds in (one_token, FEEDS, long_prefill):
        for step_a, step_b in zip(run_steps(with_fma, model, feeds), run_steps(without, model, feeds)):
            for a, b in zip(step_a, step_b):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
                top2 = b.topk(2, dim=-1).values
                clear = (top2[:, 0] - top2[:, 1]) > 1e-4
                assert torch.equal(a.argmax(-1)[clear], b.argmax(-1)[clear])


def test_native_float32_forward_stores_bf16_weights_only_where_that_is_exact(monkeypatch):
    """A bf16 checkpoint loaded in float32 (every weight a bf16 value): the forward's matmuls of up to 8 rows
    read bf16 copies of the weights (half the bytes), more rows the float32 ones, and the logits are bit for bit
    those of the same forward without the copies (SPLITSPEC_BF16_WEIGHTS=0), at 1-8 rows, batches and prefills
    past 64 rows. A model with one weight that is not a bf16 value gets no copies."""
    ops = fma_ops()
    model = tiny("llama")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    halves = NativeLlama(model, 128, ops)
    monkeypatch.setenv("SPLITSPEC_BF16_WEIGHTS", "0")
    full = NativeLlama(model, 128, ops)
    monkeypatch.delenv("SPLITSPEC_BF16_WEIGHTS")
    assert halves.bf16_weights and {w.dtype for w in halves.parts16} == {torch.bfloat16}
    assert {w.dtype for w in halves.parts} == {torch.float32} and len(halves.parts16) == len(halves.parts)
    assert not full.bf16_weights and full.parts16 == []
    few_rows = [[[5, 6, 7, 8, 9, 10, 11]], [[40]], [[41]], [[42, 43, 44, 45, 46]], [[47, 48, 49, 50, 51, 52, 53, 54]]]
    long_prefill = [[[3 + (7 * i) % 90 for i in range(70)]], [[50, 51, 52]]]
    for feeds in (few_rows, FEEDS, long_prefill):
        for step_a, step_b in zip(run_steps(halves, model, feeds), run_steps(full, model, feeds)):
            for a, b in zip(step_a, step_b):
                assert torch.equal(a, b)
    # which weights a pass reads: zeroed copies change the logits of passes of up to 8 rows only
    zeroed = copy.copy(halves)
    zeroed.parts16 = [torch.zeros_like(w) for w in halves.parts16]
    for feeds, rows in (([[[5, 6, 7, 8, 9, 10, 11, 12]]], 8), ([[[5, 6, 7, 8, 9, 10, 11, 12, 13]]], 9)):
        (a,), (b,) = run_steps(zeroed, model, feeds), run_steps(full, model, feeds)
        assert torch.equal(a[0], b[0]) == (rows > 8)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 2.0 ** -20  # not a bf16 value any more
    assert not NativeLlama(model, 128, ops).bf16_weights


def amx_ops():
    """The native ops where this CPU and OS run AMX tiles; a skip elsewhere (Linux grants the tile state on
    request, and a sandbox may refuse it)."""
    from core.models import cpu_flags

    ops = native_ops()
    if not {"amx_bf16", "amx_tile"} <= cpu_flags():
        pytest.skip("no AMX on this CPU")
    if not ops.amx_supported():
        pytest.skip("the CPU has AMX but the OS did not grant its tile state (arch_prctl)")
    return ops


def test_amx_linear_is_the_float32_sum_rounded_once():
    """AMX matmuls of 1-16 rows over weights packed into tiles: within one bf16 rounding of the float64
    result, bias included, for the shapes a model has (K a multiple of 32, N of 16)."""
    ops = amx_ops()
    g = torch.Generator().manual_seed(0)
    for n_out, width in ((16, 32), (128, 64), (1536, 512), (512, 1408)):
        w = torch.randn(n_out, width, generator=g).bfloat16()
        tiles = ops.amx_pack(w)
        assert tiles.shape == (n_out // 16, width // 32, 16, 16, 2)
        # k-pair 3, output 5
        assert torch.equal(tiles[1 % tiles.shape[0], 0, 3, 5], w[(1 % tiles.shape[0]) * 16 + 5, 6:8])
        for T in (1, 2, 5, 9, 16):
            x = torch.randn(T, width, generator=g).bfloat16()
            for bias in (torch.randn(n_out, generator=g).bfloat16(), torch.empty(0, dtype=torch.bfloat16)):
                y = ops.amx_linear(x, tiles, bias)
                assert_one_rounding(y, x, w, bias)
    with pytest.raises(RuntimeError, match="amx_pack"):
        ops.amx_pack(torch.zeros(20, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bias of 16"):  # a bias that does not fit is refused, not read past
        ops.amx_linear(torch.zeros(1, 32, dtype=torch.bfloat16),
                       ops.amx_pack(torch.zeros(16, 32, dtype=torch.bfloat16)), torch.zeros(8, dtype=torch.bfloat16))


def test_native_bf16_forward_on_amx_as_without_it():
    """The forward with its matmuls of up to 16 rows on AMX tiles (verification, batches) against the same
    forward on the GEMV and oneDNN: the same logits up to a flipped rounding, the same greedy token wherever
    the top two are apart. The LM head (97 outputs) does not tile and takes the other paths in the same pass."""
    ops = amx_ops()
    model = biased_bf16_qwen2()
    with_amx, without = NativeLlama(model, 128, ops), NativeLlama(model, 128, ops)
    without.tiles = []
    assert with_amx.amx and len(with_amx.tiles) == 4 * 3 + 1 and with_amx.tiles[-1].numel() == 0
    steps = [[[5, 6, 7, 8, 9, 10, 11]], [[40]], [[41, 42, 43, 44, 45]], [[46, 47, 48, 49, 50, 51, 52, 53, 54]]]
    assert_same_up_to_a_rounding(with_amx, without, model, (steps, FEEDS))


def test_native_forward_falls_back_and_refuses_clearly(monkeypatch):
    """SPLITSPEC_NATIVE=0 (or a machine where it cannot be built): auto runs the eager compact
    forward; asking for native there, or for a model it does not support, is refused by name."""
    import core.native

    model = tiny("llama")
    assert make_runner(model, 128).kind == ("native" if native_ops() else "compact")
    monkeypatch.setenv("SPLITSPEC_NATIVE", "0")
    core.native.load.cache_clear()
    try:
        assert make_runner(model, 128).kind == "compact"
        with pytest.raises(ValueError, match="native is unavailable here .SPLITSPEC_NATIVE=0"):
            make_runner(model, 128, "native")
    finally:
        monkeypatch.delenv("SPLITSPEC_NATIVE")
        core.native.load.cache_clear()
    assert make_runner(model, 128, "native").kind == "native"
    half = tiny("llama").to(torch.float16)  # the native loops compute float32 and bf16: float16 runs eager
    assert make_runner(half, 128).kind == "compact"
    with pytest.raises(ValueError, match="native computes float32 and bfloat16, not torch.float16"):
        make_runner(half, 128, "native")
    model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="native does not support"):
        make_runner(model, 128, "native")


def test_a_build_lock_left_by_a_dead_builder_is_removed_a_live_ones_waited_for(tmp_path):
    """The native forward's build lock: a lock older than STALE_LOCK_S (a process killed mid-build) is
    removed; a fresh one is waited for until its builder removes it; each checkout builds in its own
    directory (torch's builder rebuilds when the source's path changes)."""
    import os
    import threading
    import time

    import core.native

    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - core.native.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    core.native._wait_for_lock(tmp_path)
    assert not lock.exists()
    lock.touch()  # a live build: its builder removes the lock after 0.3 s
    removed = threading.Event()

    def builder_done():
        removed.set()  # (first: the wait may return the moment the lock is gone)
        lock.unlink()

    threading.Timer(0.3, builder_done).start()
    core.native._wait_for_lock(tmp_path, poll_s=0.02)
    assert removed.is_set() and not lock.exists()  # it returned only once the builder had removed its lock
    core.native._wait_for_lock(tmp_path)  # no lock: returns at once
    here = core.native.kernel_dir().name
    assert here.startswith(torch.__version__.replace("+", "-")) and here != core.native.kernel_dir().parent.name
    try:
        core.native.SOURCE = tmp_path / "other" / "decoder.cpp"  # the same source in another checkout
        assert core.native.kernel_dir().name != here
    finally:
        core.native.SOURCE = Path(core.native.__file__).parent / "csrc" / "decoder.cpp"
    assert core.native.kernel_dir().name == here


def test_captured_hidden_states_are_the_residual_stream_entering_each_layer():
    """EAGLE-3's auxiliary states: layer id L is the stream entering decoder layer L, which is
    transformers' ``hidden_states[L]`` (index 0: the embeddings)."""
    model = tiny("llama")
    capture = (0, 1, 2)
    (_, states), = run_steps(CompactLlama(model, 128), model, FEEDS[:1], capture)
    (_, hf_states), = run_steps(HFRunner(model), model, FEEDS[:1], capture)
    for i, toks in enumerate(FEEDS[0]):
        with torch.inference_mode():
            want = model(input_ids=torch.tensor([toks]), output_hidden_states=True).hidden_states
        for L in capture:
            assert states[i][L].shape == (len(toks), 64)
            torch.testing.assert_close(states[i][L], want[L][0], atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(hf_states[i][L], want[L][0], atol=2e-5, rtol=1e-4)


def test_runner_choice_and_unsupported_models():
    model = tiny("llama")
    assert make_runner(model, 128, "compact").kind == "compact"
    assert make_runner(model, 128, "transformers").kind == "transformers"
    model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert "dynamic" in compact_unsupported(model, 128)
    assert make_runner(model, 128).kind == "transformers"
    with pytest.raises(ValueError, match="compact does not support"):
        make_runner(model, 128, "compact")


def test_dtype_auto():
    want = "bfloat16" if cpu_has_fast_bf16() else "float32"
    assert resolve_dtype("auto", "cpu") == want
    assert resolve_dtype("float16", "cpu") == "float16"
    assert resolve_kv_dtype("auto", "bfloat16", "cpu") == "float32"  # CPU attention kernels are fast in float32
    assert resolve_kv_dtype("auto", "bfloat16", "cuda") == "bfloat16"
    assert resolve_kv_dtype("bfloat16", "bfloat16", "cpu") == "bfloat16"


def test_bf16_greedy_equals_target_generate_up_to_the_first_near_tie():
    """The shipped target in bf16: the engine's greedy tokens equal the model's own bf16 ``generate``
    until a position where the top two logits are within bf16's resolution (ties break by rounding
    order there, and both continuations are the target's greedy choice up to rounding)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from configs import DraftModelConfig, SamplingParams, VerifierConfig
    from core.loop import generate
    from drafter.model_drafter import ModelDrafter
    from offline.training.corpus import held_out_prompts
    from verifier.engine import VerifierEngine

    root = Path(__file__).resolve().parent.parent / "models"
    tok = AutoTokenizer.from_pretrained(root / "tiny-code-target")
    target = AutoModelForCausalLM.from_pretrained(root / "tiny-code-target", dtype=torch.bfloat16).eval()
    ver = VerifierEngine(VerifierConfig(model=str(root / "tiny-code-target"), dtype="bfloat16", cache_budget_mb=64),
                         tokenizer=tok)
    dr = ModelDrafter(DraftModelConfig(model=str(root / "tiny-code-drafter"), dtype="bfloat16", cache_budget_mb=16))
    assert ver.dtype == torch.bfloat16 and ver.runner.kind == "native" and dr.runner.kind == "native"
    prompts = [tok(p)["input_ids"] for p in held_out_prompts(4)]
    seqs = generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), 4, dr, ver)
    identical = 0
    for p, s in zip(prompts, seqs):
        ids = torch.tensor([p])
        with torch.inference_mode():
            want = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48,
                                   min_new_tokens=48, pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        first = next((i for i, (a, b) in enumerate(zip(s.output_ids, want)) if a != b), None)
        if first is None:
            identical += 1
            continue
        with torch.inference_mode():
            logits = target(input_ids=torch.tensor([p + want[:first]])).logits[0, -1].float()
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) <= 0.125, (first, top2)  # within two bf16 steps at this magnitude
    assert identical >= 2


@pytest.mark.parametrize("runner_kind", ["compact", "native"])
def test_fragmented_block_tables_are_gathered_not_viewed(runner_kind):
    """A block table whose first and last blocks look consecutive but whose middle is elsewhere
    (X=[1,2], A=[3], Y=[4]; X released; A grows into 1, Z takes 2, A grows into 5) must be read by
    gathering: a view would read, and write into, another sequence's blocks."""
    model = tiny("llama")
    cache = PagedKVCache(model.config, 128, 8 * 2**20, torch.float32)
    runner = CompactLlama(model, 128) if runner_kind == "compact" else NativeLlama(model, 128, native_ops())
    bs = cache.block_size

    def grow(seq, n, toks=None):
        slot = cache.slots.get(seq) or cache.claim(seq, 0, None, [5] * (n + 1), set())
        cache.reserve(seq, n, {seq})
        return slot

    grow("X", 2 * bs), grow("A", bs), grow("Y", bs)
    assert [cache.slots[s].blocks for s in "XAY"] == [[1, 2], [3], [4]]
    cache.release("X")
    grow("A", 2 * bs)
    grow("Z", bs)
    grow("A", 3 * bs)
    a = cache.slots["A"]
    assert a.blocks == [3, 1, 5] and a.first_row_if_contiguous(3 * bs, bs) is None
    # A's forward over 40 tokens in that table equals one uncached pass; Y's rows are untouched
    y_rows = cache.k[0][4 * bs:5 * bs].clone()
    toks = [(7 * i) % 90 + 3 for i in range(40)]
    (logits,) = batched_forward(runner, cache, [a], [toks], [len(toks)])
    with torch.inference_mode():
        want = model(input_ids=torch.tensor([toks])).logits[0]
    torch.testing.assert_close(logits, want, atol=2e-5, rtol=1e-4)
    assert torch.equal(cache.k[0][4 * bs:5 * bs], y_rows)


def test_a_slots_rows_follow_its_block_table_as_it_changes():
    """``Slot.rows`` keeps the rows of its block table between passes; every change to the table
    (growing, trimming on a rollback, blocks handed back and taken by another sequence, then taken
    again) must show in the rows it returns."""
    cache = PagedKVCache(tiny("llama").config, 128, 8 * 2**20, torch.float32)
    bs = cache.block_size

    def want(slot, n):
        return [slot.blocks[p // bs] * bs + p % bs for p in range(n)]

    a = cache.claim("A", 0, None, [5] * (bs + 1), set())
    cache.reserve("A", 2 * bs, {"A"})
    assert a.rows(2 * bs, bs).tolist() == want(a, 2 * bs)
    cache.claim("B", 0, None, [5] * 3, set())
    cache.reserve("B", bs, {"B"})  # takes the block after A's
    cache.reserve("A", 3 * bs, {"A"})  # so A's third block is not consecutive
    assert a.rows(3 * bs, bs).tolist() == want(a, 3 * bs) and a.rows(5, bs).tolist() == want(a, 5)
    a.tokens[:] = [5] * (bs + 1)
    cache.claim("A", 3, prefix_hash(a.tokens, 3), None, set())  # a rollback to 3 tokens trims to 2 blocks
    assert len(a.blocks) == 2 and a.rows(2 * bs, bs).tolist() == want(a, 2 * bs)
    cache.release("B")
    cache.reserve("A", 3 * bs, {"A"})  # the freed block after A's second is taken again
    assert a.rows(3 * bs, bs).tolist() == want(a, 3 * bs)
    with pytest.raises(ValueError):
        a.rows(3 * bs + 1, bs)
