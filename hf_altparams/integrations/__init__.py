"""Integrations with Accelerate (:mod:`.accelerate`) and the Trainer (:mod:`.trainer`).

Import the submodule you use; this package imports neither eagerly, so that
``import hf_altparams`` does not pay for importing transformers.
"""
