"""The algorithm: advantages (every estimator), the losses, and how samples are packed into batches."""
