class BaseTunerLayer:
    # the names of the attributes (ModuleDict / ParameterDict, adapter name -> weights) holding the adapters' weights
    adapter_layer_names: tuple[str, ...]
