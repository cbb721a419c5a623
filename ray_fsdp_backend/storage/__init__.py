"""Files on any ``pyarrow.fs`` filesystem (local, S3, GCS): resolving a URI
(:mod:`.filesystem`), retries with a budget (:mod:`.retry`), a filesystem that
retries and streams (:mod:`.retrying_fs`), whole-or-absent files
(:mod:`.whole_file`). Imports nothing else of the package."""
