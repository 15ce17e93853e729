"""Built-in device backends, one module per kind; each module names its class ``device_class``."""
