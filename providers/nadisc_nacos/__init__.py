"""Nacos provider for nadisc: instance-list discovery and registration over the open API.

Loaded through the ``nadisc.providers`` entry point ``nacos``::

    connections:
      primary:
        provider: nacos
        nacos:
          server_addr: http://nacos-business:8848/nacos/
          namespace: public
          group: BUSINESS
          username: ${BUSINESS_NACOS_USERNAME}
          password: ${BUSINESS_NACOS_PASSWORD}
          services:
            orders: {name: order-worker}

Speaks the v3 client API of Nacos 3.x or the v1 open API of 1.x/2.x
(``api: auto`` probes once at prepare). See ``docs/providers-nacos.md`` for
the settings, the evidence rules (protect threshold = weaker evidence), auth
and registration.
"""

from ._http import NacosHttp as NacosHttp
from ._provider import NacosProvider as NacosProvider
from ._provider import NacosProviderFactory as NacosProviderFactory
from ._provider import factory as factory
from ._settings import NacosServiceBinding as NacosServiceBinding
from ._settings import NacosSettings as NacosSettings
from ._wire import Listing as Listing
from ._wire import decode_instance_list as decode_instance_list

__all__ = [
    "Listing",
    "NacosHttp",
    "NacosProvider",
    "NacosProviderFactory",
    "NacosServiceBinding",
    "NacosSettings",
    "decode_instance_list",
    "factory",
]
