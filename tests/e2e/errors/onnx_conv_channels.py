"""A convolution whose weights expect 3 input channels, given an image of 2.

needs: onnx
raises: ShapeError
says: Conv node 'conv': 2 input channels do not fit weights [4, 3, 3, 3] with group=1
"""

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import cuvil.onnx

x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 8, 8])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
w = numpy_helper.from_array(np.zeros((4, 3, 3, 3), np.float32), "w")
graph = helper.make_graph([helper.make_node("Conv", ["x", "w"], ["y"], name="conv", kernel_shape=[3, 3])], "g",
                          [x], [y], [w])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
cuvil.onnx.InferenceSession(model.SerializeToString())
