"""Data coordinator: per-process loading, batches, layouts and re-partitions.

Modules (one job each):
  assign       length-balanced destination assignment (pure numpy, LPT-style)
  layout       Layout = mesh + sample-sharding axes; equivalence = fast path
  plan         the re-partition plan as index arrays, and its traffic
  redistribute fast path / one all_to_all / centralized baseline
  batch        Batch = sample-leading arrays + host-side fields by group id
  sources      random-access JSONL and Parquet readers
  rows         one raw row -> a validated, rendered, tokenized example (or why not)
  loader       grain prompt pipeline per process with exact iterator state
  image_loading  a row's image references -> decoded PIL images (paths, base64, bytes)
  image_processor  Qwen2-VL preprocessing: an image -> pixel_values and its grid
  images       image placeholder tokens and prompt encoding (re-exports the two above)
"""
