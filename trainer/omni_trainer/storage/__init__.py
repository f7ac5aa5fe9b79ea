"""Files by URL: a local path or ``s3://bucket/key``, read whole with retries (:mod:`.blobs`)
through one S3 client (:mod:`.s3`). Torch-free."""
