# Type stubs for the part of peft (0.21) that hf_altparams.integrations.peft uses. peft ships its own types, but
# type-checking the package against them makes mypy analyse peft and what it imports (huggingface_hub, pydantic,
# rich, IPython, matplotlib, ...: some 1,200 modules); this stub stands in for it (setup.cfg: `mypy_path`, and
# `follow_imports = error` for peft). The module itself is `Any` to the package (peft is optional there), so
# only the two classes imported by name are here, typed as peft annotates them. Not shipped.
# tests/integrations/test_peft_stubs.py checks them against the installed peft.
