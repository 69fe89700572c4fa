"""The remote tier: a store shared by the daemons of many nodes (Redis Cluster first).

entry.py lays an entry out in keys and values, store.py is the contract every adapter
keeps and its config, incidents.py remembers failing nodes, resp.py packs commands and
sorts Redis' errors, redis_cluster.py is the adapter.
"""
