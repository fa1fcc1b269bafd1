"""What a run shows and keeps about itself: MLflow tracking, the data report, the run summary."""
