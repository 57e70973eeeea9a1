"""The Triton Python-backend glue: the spec_decode service, BLS calls to the target and
drafter models, their workers, metrics, the model repository's configuration."""
