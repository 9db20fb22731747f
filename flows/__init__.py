"""The offline wing: Prefect flows that run offline workloads in large batches.

flows.batch       the flow (`offline`): plan, run the shards, write the manifest
flows.scheduling  a run's shard tasks on its task runner, bounded, stopped at a deadline
flows.shard_task  the per-shard Prefect task, and the model each process loads for it
flows.progress    a run's progress events, for `lanes run`'s bar
flows.shard       one shard end to end: read, batch, run, write, commit
flows.records     input shards -> numbered records (JSONL, CSV, JSON arrays, Parquet)
flows.shape       a workload's `fields:` and `pre`: a plain record -> id, item, kept fields
flows.requests    a record -> task items, and outputs -> its output line
flows.validate    a sample of the records checked against their shape before a run
flows.job         a job planned: URIs, resume keys, one plan per shard
flows.manifest    the record a run leaves beside its outputs
flows.outcome     a run's deadline and final state
flows.compile     offline workloads -> prefect.yaml
flows.embedded    `lanes run`'s embedded Prefect server, tied to `lanes run`'s life
"""

# The flow every offline workload runs; its deployments are "lanes-offline/<workload>".
FLOW_NAME = "lanes-offline"
# Where prefect.yaml points: a module path, valid wherever lanes is installed.
ENTRYPOINT = "lanes.flows.batch:offline"
