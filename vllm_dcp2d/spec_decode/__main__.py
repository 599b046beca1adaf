from vllm_dcp2d.spec_decode.draft import memory_table

memory_table()
