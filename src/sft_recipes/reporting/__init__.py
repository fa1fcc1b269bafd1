"""What a run shows, keeps and shares about itself: MLflow tracking, the data report, the run summary, the
curves picture, sample generations, the model card and the Hub push."""
