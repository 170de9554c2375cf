"""The segmentation task (2D and 3D): its data (``data``), prediction and the task itself."""
