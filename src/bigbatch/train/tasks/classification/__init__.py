"""The classification task: its data (``data``), metrics, prediction and the task itself."""
