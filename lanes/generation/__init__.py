"""Generation, both lanes' one implementation: continuous batching over a decoder.

- `scheduler`: the pure part, which sequences run each step and what came of it
  (stop strings, token budgets, the model's context, detokenising, sampling,
  `ignore_eos`);
- `kvcache`: the batch's KV cache, rows in groups of similar length;
- `prefill`: joiners' prompts in one left-padded run, isolated when it fails;
- `loop`: the plain synchronous step loop, plan -> model runs -> update;
- `batch`: offline generation, many prompts through the loop with rows refilled.

The online engine (serving/engine.py) wraps the loop with a thread, arrivals and
streams; the offline shard (flows/shard.py, through `GenerateTask.run`) drives it
until every prompt is done.
"""
