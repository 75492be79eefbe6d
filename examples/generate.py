"""Generate text with the tiny preset checkpoint, prefix caching on (PD-CC): the second
question shares the first one's context, whose KV the pool kept.

Run: python examples/generate.py  (or pass a Llama-family checkpoint directory)"""

import sys

from minimemserve import LLM, SamplingParams

CONTEXT = "A memory pool owns every block of KV cache; requests borrow blocks and give them back. "


def main(model_dir: str | None) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    with LLM(model_dir, config="PD-CC", num_blocks=64) as llm:  # None: the tiny preset
        for question in ("Who owns the blocks?", "Who borrows them?"):
            (out,) = llm.generate([CONTEXT + question], params)
            print(f"{question!r} -> {out.text!r} ({out.metrics.cached_tokens} tokens cached)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
