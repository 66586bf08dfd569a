"""What gspo reads, writes and says: run files written whole (atomic rewrites, JSON lines), Hugging Face
Hub ids, where metrics go (metrics.jsonl, TensorBoard, W&B) and the words of its messages.

The ground floor: imports nothing of gspo.
"""
