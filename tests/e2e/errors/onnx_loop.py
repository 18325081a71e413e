"""A ``Loop`` that is not an embedding bag and whose trip count is known only when it runs.

needs: onnx
raises: UnsupportedOpError
says: Loop node 'steps': the loop-carried value 'x' is neither an empty sequence nor an integer counter
says: cuvil compiles a Loop as an embedding bag
"""

from onnx import TensorProto, helper

import cuvil.onnx

T = TensorProto
body = helper.make_graph(
    [helper.make_node("Add", ["v", "one"], ["v2"]), helper.make_node("Identity", ["c"], ["c2"])], "body",
    [helper.make_tensor_value_info("k", T.INT64, []), helper.make_tensor_value_info("c", T.BOOL, []),
     helper.make_tensor_value_info("v", T.FLOAT, [4])],
    [helper.make_tensor_value_info("c2", T.BOOL, []), helper.make_tensor_value_info("v2", T.FLOAT, [4])],
    [helper.make_tensor("one", T.FLOAT, [], [1.0])])
n = helper.make_tensor_value_info("n", T.INT64, [])
x = helper.make_tensor_value_info("x", T.FLOAT, [4])
y = helper.make_tensor_value_info("y", T.FLOAT, [4])
graph = helper.make_graph([helper.make_node("Loop", ["n", "", "x"], ["y"], name="steps", body=body)], "g", [n, x], [y])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
cuvil.onnx.InferenceSession(model.SerializeToString())
