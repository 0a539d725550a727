import Foundation
import GemmaANE

/// What stands in for the Neural Engine: each package's functions run by a `ChunkRunner` over the Python MIL
/// executor (Linux has no Core ML), so the Core ML runner's own code — compiling, loading one model per function,
/// states, strides — runs here unchanged, as tests/coreml_standin.py lets the Python runtime's Core ML path run.
///
/// Where it differs from Core ML, by choice: every output comes back with its rows padded (strides past the
/// packed ones, the padding NaN) as the ANE's aligned buffers may, so a reader that ignores strides reads garbage;
/// functions named by `refusing(_:)` fail to load on the Neural Engine (`.all`, `.cpuAndNeuralEngine`), as an ANE
/// compile failure would; every compute unit runs the same executor.
///
/// The compiled form `compileModel(at:)` writes (only this stand-in can load it): `NAME.mlmodelc/standin.json`,
/// `{"source": the package's absolute path}`.
public final class StandInDevice: @unchecked Sendable {
    public static let shared = StandInDevice()
    static let marker = "standin.json"

    /// One package as the stand-in runs it: every model loaded from it (any function, any compiled copy) shares
    /// this runner, so they share its states, as a multifunction package's models do.
    final class Chunk {
        let source: URL
        let runner: any ChunkRunner

        init(source: URL, runner: any ChunkRunner) {
            self.source = source
            self.runner = runner
        }
    }

    private let lock = NSLock()
    private var chunks: [String: Chunk] = [:]
    private var refused: Set<String> = []
    private var compiled = 0
    private var clients: [String: PipeClient] = [:]
    private var interpreter = ProcessInfo.processInfo.environment["GEMMA_ANE_PYTHON"] ?? "python3"

    /// The Python interpreter that runs `gemma_ane.mil.serve` (GEMMA_ANE_PYTHON, else python3 on PATH), for
    /// the packages this stand-in has not opened yet.
    public var python: String {
        get { lock.withLock { interpreter } }
        set { lock.withLock { interpreter = newValue } }
    }

    /// How many packages `compileModel(at:)` has compiled in this process.
    public var compilations: Int { lock.withLock { compiled } }

    /// Runs `body` with `functions` refused on the Neural Engine, then refuses none again.
    public func refusing<R>(_ functions: Set<String>, _ body: () async throws -> R) async rethrows -> R {
        lock.withLock { refused = functions }
        defer { lock.withLock { refused = [] } }
        return try await body()
    }

    func compile(_ package: URL) throws -> URL {
        guard package.pathExtension == "mlpackage" else {
            throw StandInError("\(package.path): not an .mlpackage")
        }
        _ = try chunk(source: package.standardizedFileURL)  // a package the executor cannot open fails here
        let directory = FileManager.default.temporaryDirectory.appendingPathComponent("standin-\(UUID().uuidString)")
        let compiledURL = directory.appendingPathComponent(
            package.deletingPathExtension().lastPathComponent + ".mlmodelc")
        try FileManager.default.createDirectory(at: compiledURL, withIntermediateDirectories: true)
        let record = try JSONSerialization.data(withJSONObject: ["source": package.standardizedFileURL.path])
        try record.write(to: compiledURL.appendingPathComponent(Self.marker))
        lock.withLock { compiled += 1 }
        return compiledURL
    }

    /// The package behind a compiled model this stand-in made.
    func chunk(compiled url: URL) throws -> Chunk {
        guard url.pathExtension == "mlmodelc" else {
            throw StandInError("\(url.path): compile the model first (Core ML loads a .mlmodelc)")
        }
        let markerURL = url.appendingPathComponent(Self.marker)
        guard let data = try? Data(contentsOf: markerURL),
            let record = try? JSONSerialization.jsonObject(with: data) as? [String: Any],
            let source = record["source"] as? String
        else {
            throw StandInError("\(url.path): not a compiled model this stand-in made (no \(Self.marker))")
        }
        return try chunk(source: URL(fileURLWithPath: source))
    }

    /// A package's chunk, run through the pipe server of its bundle (the package's directory: one server a
    /// bundle, started on first use).
    private func chunk(source: URL) throws -> Chunk {
        try lock.withLock {
            if let chunk = chunks[source.path] { return chunk }
            let bundle = source.deletingLastPathComponent()
            let client = try clients[bundle.path] ?? PipeClient(bundle: bundle, python: interpreter)
            clients[bundle.path] = client
            let name = String(source.lastPathComponent.split(separator: ".").first ?? "")
            guard let described = client.chunks.first(where: { $0.name == name }) else {
                throw StandInError("\(source.path): the executor holds no chunk \(name)")
            }
            let chunk = Chunk(source: source, runner: PipeRunner(client: client, chunk: described))
            chunks[source.path] = chunk
            return chunk
        }
    }

    func load(_ chunk: Chunk, function: String, on units: MLComputeUnits) throws {
        let refuse = lock.withLock { refused.contains(function) }
        if refuse && (units == .all || units == .cpuAndNeuralEngine) {
            throw StandInError("\(chunk.source.path): ANECCompile FAILED for function \(function) (the stand-in refuses it)")
        }
        try chunk.runner.load(function)
    }

    /// A tensor as a multi-array; `padded`: each innermost row padded to the next multiple of 64 elements past
    /// its length, the padding NaN.
    static func multiArray(_ tensor: Tensor, padded: Bool) throws -> MLMultiArray {
        let shape = tensor.shape
        let size = tensor.dtype.size
        var strides = [Int](repeating: 1, count: shape.count)
        var rows = shape.last ?? 1
        if padded { rows = (rows / 64 + 1) * 64 }
        for axis in stride(from: shape.count - 2, through: 0, by: -1) {
            strides[axis] = (axis == shape.count - 2 ? rows : strides[axis + 1] * shape[axis + 1])
        }
        let elements = shape.isEmpty ? 1 : strides[0] * shape[0]
        let memory = UnsafeMutableRawPointer.allocate(byteCount: max(elements * size, 1), alignment: 16)
        memory.initializeMemory(as: UInt8.self, repeating: 0xFF, count: elements * size)
        tensor.bytes.withUnsafeBytes { packed in
            for index in 0..<tensor.count {
                let offset = Self.offset(of: index, shape: shape, strides: strides)
                (memory + offset * size).copyMemory(from: packed.baseAddress! + index * size, byteCount: size)
            }
        }
        return try MLMultiArray(
            dataPointer: memory, shape: shape.map { NSNumber(value: $0) }, dataType: MLMultiArrayDataType(tensor.dtype),
            strides: strides.map { NSNumber(value: $0) }, deallocator: { $0.deallocate() })
    }

    /// A multi-array's elements read through its strides, packed.
    static func tensor(_ array: MLMultiArray) throws -> Tensor {
        guard let dtype = array.dataType.dtype else {
            throw StandInError("a multi-array of doubles: the executor takes float16, float32 and int32")
        }
        let shape = array.shape.map(\.intValue)
        let strides = array.strides.map(\.intValue)
        var bytes = Data(count: array.count * dtype.size)
        array.withUnsafeBytes { storage in
            bytes.withUnsafeMutableBytes { packed in
                for index in 0..<array.count {
                    let offset = Self.offset(of: index, shape: shape, strides: strides)
                    (packed.baseAddress! + index * dtype.size).copyMemory(
                        from: storage.baseAddress! + offset * dtype.size, byteCount: dtype.size)
                }
            }
        }
        return Tensor(shape: shape, dtype: dtype, bytes: bytes)
    }

    /// Where the `index`-th element in row-major order lives, element by element (deliberately not the
    /// runner's row-wise copy, so one cannot hide the other's mistake).
    private static func offset(of index: Int, shape: [Int], strides: [Int]) -> Int {
        var rest = index
        var offset = 0
        for axis in stride(from: shape.count - 1, through: 0, by: -1) {
            offset += (rest % shape[axis]) * strides[axis]
            rest /= shape[axis]
        }
        return offset
    }
}
