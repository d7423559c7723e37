"""Data coordinator: per-process loading, batches, layouts and re-partitions.

Modules (one job each):
  assign       length-balanced destination assignment (pure numpy, LPT-style)
  layout       Layout = mesh + sample-sharding axes; equivalence = fast path
  plan         the re-partition plan as index arrays, and its traffic
  redistribute fast path / one all_to_all / centralized baseline
  batch        Batch = sample-leading arrays + host-side fields by group id
  sources      random-access JSONL and Parquet readers
  loader       grain prompt pipeline per process with exact iterator state
  images       image rows: loading, Qwen2-VL preprocessing, image placeholder tokens
"""
