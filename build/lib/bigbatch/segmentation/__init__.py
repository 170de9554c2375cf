"""Segmentation (2D images and 3D volumes): losses that accumulate exactly, metrics accumulated
over a whole set, and compact U-Nets whose normalisation is per sample.

- :mod:`bigbatch.segmentation.losses`: BCE, Dice and BCE + Dice, with Dice computed per sample
  (separable: exact under accumulation with ``count=len(batch)``); the batch-level Dice couples
  the samples and says so (``couples_samples``).
- :mod:`bigbatch.segmentation.metrics`: Dice and Jaccard per class from summed intersections
  and unions over the whole set, not means of per-batch means.
- :mod:`bigbatch.segmentation.models`: ``UNet`` (2D or 3D, GroupNorm) and ``timm_unet`` (a 2D
  U-Net decoder on any timm encoder).
"""
