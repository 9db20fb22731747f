"""The offline wing: Prefect flows that run offline workloads in large batches."""
