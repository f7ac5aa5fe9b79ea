"""Modality encoders (ViT, Conformer) and their projectors, over packed variable-length batches.

Import the submodules directly: ``config`` is torch-free (the operator validates manifests with it);
``layers``, ``vision``, ``audio`` and ``projector`` need torch. Video is not a separate encoder:
frames can be encoded as images by ``vision.VisionEncoder``.
"""
