"""placeholder"""

def is_training_args(data):
    return False
