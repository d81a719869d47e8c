"""Where a run's numbers go: records, the console, trackers (W&B, TensorBoard, MLflow),
report.html and its plots."""
