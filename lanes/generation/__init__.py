"""Generation, both lanes' one implementation: continuous batching over a decoder.

- `seq`: what it works on: a sequence, one step's plan, the model's outputs for it
  and the events it makes;
- `scheduler`: the pure part, which sequences run each step and what came of it
  (stop strings, token budgets, the model's context, detokenising, sampling,
  `ignore_eos`);
- `kvcache`: the batch's KV cache, rows in groups of similar length;
- `prefill`: joiners' prompts in one left-padded run, isolated when it fails;
- `loop`: the plain synchronous step loop, plan -> model runs -> update;
- `batch`: offline generation, many prompts through the loop with rows refilled.
- `usage`: what a completion's usage counts (a leaf, so lanes.tasks can count alike).

The offline shard (flows/shard.py, through `GenerateTask.run`) drives the loop until
every prompt is done; the online engine (serving/engine.py) drives it on a thread of
its own, with arrivals and streams around it.
"""
