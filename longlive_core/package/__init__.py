"""The model bundle of `package`: building, checksums, S3 publishing and fetching."""
