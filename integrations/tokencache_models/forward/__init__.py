"""What one forward takes and gives: its batch, its context, its on-device epilogue."""
