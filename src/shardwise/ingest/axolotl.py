"""placeholder"""

def is_axolotl(data):
    return False
