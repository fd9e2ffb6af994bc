"""RoundPipe: train models larger than device memory by streaming layers round-robin to devices."""
