"""The MemPool calls of one request on a disaggregated pair with caching (1P1D-CC): what the
prefill instance P0 matches, allocates, indexes and sends, and what the decode instance D0
receives, indexes and sends back, block ids included.

Run: python examples/pool_calls.py  (``minimemserve explain`` does this for two turns and
two configurations side by side)"""

from minimemserve import LLM, SamplingParams
from minimemserve.explain import PoolTrace, render

trace = PoolTrace()
with LLM(config="1P1D-CC", block_size=8, num_blocks=64) as llm:
    for instance in llm.engine.instances:
        trace.watch(instance.engine)  # record this engine's pool calls and recipe hooks
    prompt = llm.tokenizer.encode("A pool call is a recipe step.")
    trace.turn(f"one request: {len(prompt)} prompt tokens")
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))
    llm.engine.check_pools()  # every block is free or cached again
print(render({"1P1D-CC": trace.events}))
