"""Input side: calling input_fn, checking and stacking batches, prefetching to devices."""
