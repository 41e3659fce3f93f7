from . import config_args as config_args
from .config_args import default_config_file as default_config_file
from .config_args import load_config_from_file as load_config_from_file
