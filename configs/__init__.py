"""ml-collections configs: each file has get_config(arg=None); common.py holds shared defaults."""
