from collections import OrderedDict

# model_type -> the name of its head class, per auto class
MODEL_FOR_CAUSAL_LM_MAPPING_NAMES: OrderedDict[str, str]
MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES: OrderedDict[str, str]
MODEL_FOR_MASKED_LM_MAPPING_NAMES: OrderedDict[str, str]
MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES: OrderedDict[str, str]
