"""The runtime seed's multi-Nacos YAML example ("napp 自动接管与多 Nacos"), verbatim.

Shared by the config-loading tests and the end-to-end Nacos seed test.
"""

SEED_EXAMPLE = """\
application:
  name: order-api
server:
  host: 0.0.0.0
  port: 8080
  health: true
discovery:
  enabled: true
  eligibility_probe: true
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
          self: {name: order-api}
          orders: {name: order-worker}
      rest:
        request_timeout_ms: 5000
        connect_timeout_ms: 1000
        lb_strategy: weighted
    infrastructure:
      provider: nacos
      nacos:
        server_addr: http://nacos-infra:8848/nacos/
        namespace: public
        group: INFRASTRUCTURE
        username: ${INFRA_NACOS_USERNAME}
        password: ${INFRA_NACOS_PASSWORD}
        services:
          coordinator: {name: saga-server}
  registrations:
    business-http:
      qualifier: primary
      service_name: self
      listener_ref: web
      eligibility_ref: web
      ip: ${BUSINESS_REGISTER_IP}
      port: 18080
      startup_required: true
      readiness_critical: true
"""
