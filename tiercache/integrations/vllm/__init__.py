"""tiercache as a vLLM KV connector for hybrid attention + Mamba/GDN models.

Load it with `--kv-transfer-config` (`kv_connector_module_path`:
"tiercache.integrations.vllm.connector", `kv_connector`: "TiercacheConnector"); see the
README's vLLM section. `connector` imports vLLM; `pages`, `jobs`, `worker_side` and
`scheduler_side` do not, so the data path can be tested where vLLM is not installed.
"""
