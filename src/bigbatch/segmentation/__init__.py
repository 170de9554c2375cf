"""Segmentation (2D images and 3D volumes): losses that accumulate exactly, metrics accumulated
over a whole set, and compact U-Nets whose normalisation is per sample.

- :mod:`bigbatch.segmentation.losses`: BCE, Dice and BCE + Dice, with Dice computed per sample
  (separable: exact under accumulation with ``count=len(batch)``); the batch-level Dice couples
  the samples and says so (``couples_samples``).
- :mod:`bigbatch.segmentation.metrics`: Dice and Jaccard per class from summed intersections
  and unions over the whole set, not means of per-batch means.
- :mod:`bigbatch.segmentation.models`: ``UNet`` (2D or 3D, GroupNorm, no dependency).
- :mod:`bigbatch.segmentation.networks`: MONAI's networks by name (2D or 3D).
- :mod:`bigbatch.segmentation.decoders`: segmentation_models_pytorch's U-Net, U-Net++, FPN and
  DeepLabV3+ on any timm encoder (2D).
- :mod:`bigbatch.segmentation.rle` and :mod:`bigbatch.segmentation.postprocess`: Kaggle's
  run-length encoded masks, the competition's Dice, per-class post-processing, submissions.
"""
