from torch import nn

class AuxiliaryTrainingWrapper(nn.Module):
    adapter_layer_names: tuple[str, ...]
