"""placeholder"""

def is_llama_factory(data):
    return False
