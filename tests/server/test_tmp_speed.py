import time, httpx
def test_speed(real_client):
    t=time.time(); r=real_client.post("/v1/completions", json={"prompt": "x", "max_tokens": 250, "temperature": 0, "ignore_eos": True}); print("250 tok", time.time()-t, r.json()["usage"])
    assert 0
