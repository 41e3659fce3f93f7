"""Integrations with Accelerate (:mod:`.accelerate`), the Trainer (:mod:`.trainer`) and peft (:mod:`.peft`, optional).

Import the submodule you use; this package imports none of them eagerly, so that
``import hf_altparams`` does not pay for importing transformers.
"""
