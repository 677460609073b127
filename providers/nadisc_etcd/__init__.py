"""etcd provider for nadisc (v3 JSON gateway over httpx)."""
