import Foundation

/// A tensor crossing the runner seam: a shape, a dtype and its bytes, row-major and packed
/// (a runner that gets strided memory from its device packs it before returning).
public struct Tensor: Sendable, Equatable {
    public enum DType: String, Sendable {
        case float16, float32, int32

        public var size: Int { self == .float16 ? 2 : 4 }
    }

    public var shape: [Int]
    public var dtype: DType
    public var bytes: Data

    public init(shape: [Int], dtype: DType, bytes: Data) {
        precondition(bytes.count == shape.reduce(1, *) * dtype.size, "tensor bytes do not fill shape \(shape)")
        self.shape = shape
        self.dtype = dtype
        self.bytes = bytes
    }

    public var count: Int { shape.reduce(1, *) }
}

/// One input, output or state of a chunk function, as the model itself declares it (CONTRACT §3).
public struct TensorSpec: Sendable, Equatable {
    public var name: String
    public var shape: [Int]
    public var dtype: Tensor.DType

    public init(name: String, shape: [Int], dtype: Tensor.DType) {
        self.name = name
        self.shape = shape
        self.dtype = dtype
    }
}

/// A chunk function's declared I/O.
public struct FunctionInterface: Sendable, Equatable {
    public var inputs: [TensorSpec]
    public var outputs: [TensorSpec]
    public var states: [TensorSpec]

    public init(inputs: [TensorSpec], outputs: [TensorSpec], states: [TensorSpec]) {
        self.inputs = inputs
        self.outputs = outputs
        self.states = states
    }
}

/// A chunk's state (its KV caches), owned by the engine and shared by every function of the chunk,
/// as Core ML's `MLState` is. Opaque: only the runner that made it reads or writes it.
public protocol ChunkState: AnyObject {}

/// One chunk package, as every way of running it presents it: the Swift mirror of the Python
/// `ChunkBackend` (gemma_ane/runtime/backend.py). Core ML on a Mac or iPhone, the Python MIL executor
/// over a pipe on Linux; the engine never knows which.
public protocol ChunkRunner: AnyObject {
    /// The chunk's name (`chunk_1`, ...), for messages.
    var name: String { get }
    /// Function names, the default function (`infer`) first.
    var functionNames: [String] { get }
    /// Function name -> its I/O, read from the model itself, never from a plan.
    var interfaces: [String: FunctionInterface] { get }
    /// Makes a function ready to run. `infer` is ready once the runner is open; the others (CONTRACT §3:
    /// optional) may load on first use, and a device that cannot load one throws `.functionUnavailable`.
    func load(_ function: String) throws
    /// A fresh, zeroed state every function of the chunk shares, or nil for a stateless chunk; `function` (`infer`,
    /// or a context ladder's rung `ctx{C}_infer`, CONTRACT §3a) decides its shapes.
    func makeState(_ function: String) throws -> ChunkState?
    /// Runs one function. Inputs by name in the declared dtypes; outputs by name, packed.
    func predict(_ function: String, inputs: [String: Tensor], state: ChunkState?) throws -> [String: Tensor]
    /// One state's contents in its declared dtype, and back: snapshots of the caches.
    func readState(_ state: ChunkState, name: String) throws -> Tensor
    func writeState(_ state: ChunkState, name: String, _ tensor: Tensor) throws
    /// Forgets these loaded functions (a ladder's rung left behind), whose wired weights a device then frees.
    func release(_ functions: [String])
}

extension ChunkRunner {
    /// A fresh state for `infer`: a single-context bundle's, or a ladder's top rung's.
    public func makeState() throws -> ChunkState? { try makeState("infer") }
}
