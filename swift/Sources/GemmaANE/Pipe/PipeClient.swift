#if os(macOS) || os(Linux)
import Foundation
#if canImport(Glibc)
import Glibc
#endif

/// A connection to `python -m gemma_ane.mil.serve PACKAGE...` (iOS has no Process): a bundle's chunks run by the
/// Python MIL executor, one request and one reply at a time over the child's stdin and stdout. The protocol is the
/// module's (a little-endian u32 header size, a JSON header, the raw bytes of the tensors it lists); every read is
/// bounded, and a child that dies or speaks out of step is one `.device` error, never a trap.
public final class PipeClient: @unchecked Sendable {
    /// One chunk as the server describes it: its functions (the default first) and their I/O.
    public struct Chunk: Sendable {
        public var name: String
        public var functionNames: [String]
        public var interfaces: [String: FunctionInterface]
    }

    public static let maxHeader = 1 << 20
    /// The largest tensor a reply may carry (E2B's logits are 512 KB, its biggest cache a few hundred MB).
    public static let maxTensorBytes = 1 << 32

    public let chunks: [Chunk]
    private let process: Process
    private let input: FileHandle
    private let output: FileHandle
    private let lock = NSLock()
    private var released: [Int] = []

    /// Starts the server for the chunk `packages` (in order) with `python` (a path, or a name looked up on PATH) and
    /// reads their interfaces.
    public init(packages: [URL], python: String) throws {
        signal(SIGPIPE, SIG_IGN)  // a child that died is an error on write, not a signal that kills the app
        process = Process()
        process.executableURL = try Self.resolve(python)
        process.arguments = ["-m", "gemma_ane.mil.serve"] + packages.map(\.path)
        let toChild = Pipe(), fromChild = Pipe()
        process.standardInput = toChild
        process.standardOutput = fromChild
        do {
            try process.run()
        } catch {
            throw GemmaANEError(.device, "\(python): cannot start the Python executor (\(error.localizedDescription))")
        }
        input = toChild.fileHandleForWriting
        output = fromChild.fileHandleForReading
        let (reply, _) = try Self.exchange(input, output, process, ["op": "hello"], [])
        chunks = try Self.parseChunks(reply["chunks"])
    }

    /// The server for the chunks of the bundle directory `bundle` (chunk_1 ... as BundleLayout finds them).
    public convenience init(bundle: URL, python: String) throws {
        try self.init(packages: try BundleLayout.chunkPaths(bundle), python: python)
    }

    deinit {
        try? input.close()
        process.waitUntilExit()
    }

    /// The interpreter: GEMMA_ANE_PYTHON or --python's value, a path or a name on PATH.
    static func resolve(_ python: String) throws -> URL {
        if python.contains("/") {
            guard FileManager.default.isExecutableFile(atPath: python) else {
                throw GemmaANEError(.input, "\(python): no Python interpreter there (set --python or GEMMA_ANE_PYTHON)")
            }
            return URL(fileURLWithPath: python)
        }
        let path = ProcessInfo.processInfo.environment["PATH"] ?? "/usr/bin:/bin"
        for dir in path.split(separator: ":") {
            let candidate = "\(dir)/\(python)"
            if FileManager.default.isExecutableFile(atPath: candidate) { return URL(fileURLWithPath: candidate) }
        }
        throw GemmaANEError(.input, "\(python): not found on PATH (set --python or GEMMA_ANE_PYTHON)")
    }

    /// A state id the client no longer holds: told to the server with the next request.
    func release(_ state: Int) {
        lock.lock()
        released.append(state)
        lock.unlock()
    }

    /// One request: `header` plus `tensors` (in the order given), the reply's header and tensors by name. A reply
    /// the server gives as an error is thrown as a GemmaANEError of its kind.
    public func call(_ header: [String: Any], _ tensors: [(String, Tensor)] = []) throws -> ([String: BundleJSON], [String: Tensor]) {
        lock.lock()
        defer { lock.unlock() }
        var header = header
        if !released.isEmpty {
            header["release"] = released
            released = []
        }
        return try Self.exchange(input, output, process, header, tensors)
    }

    private static func exchange(
        _ input: FileHandle, _ output: FileHandle, _ process: Process, _ header: [String: Any], _ tensors: [(String, Tensor)]
    ) throws -> ([String: BundleJSON], [String: Tensor]) {
        var header = header
        if !tensors.isEmpty {
            header["tensors"] = tensors.map { ["name": $0.0, "shape": $0.1.shape, "dtype": $0.1.dtype.rawValue] }
        }
        let body = try JSONSerialization.data(withJSONObject: header)
        var frame = Data()
        withUnsafeBytes(of: UInt32(body.count).littleEndian) { frame.append(contentsOf: $0) }
        frame.append(body)
        do {
            try input.write(contentsOf: frame)
            for (_, t) in tensors { try input.write(contentsOf: t.bytes) }
        } catch {
            throw died(process)
        }
        let size = try read(output, 4, process).withUnsafeBytes { Int(UInt32(littleEndian: $0.loadUnaligned(as: UInt32.self))) }
        guard size <= maxHeader else { throw GemmaANEError(.device, "gemma_ane.mil.serve: a reply header of \(size) bytes") }
        guard let reply = (try? JSONDecoder().decode(BundleJSON.self, from: read(output, size, process)))?.object else {
            throw GemmaANEError(.device, "gemma_ane.mil.serve: a reply header that is no JSON object")
        }
        var out: [String: Tensor] = [:]
        for spec in reply["tensors"]?.array ?? [] {
            guard let name = spec.object?["name"]?.string, let dtype = spec.object?["dtype"]?.string.flatMap(Tensor.DType.init),
                let shape = spec.object?["shape"]?.array?.compactMap(\.int), shape.allSatisfy({ $0 >= 0 })
            else { throw GemmaANEError(.device, "gemma_ane.mil.serve: a reply tensor without name, shape or dtype") }
            var bytes = dtype.size
            for d in shape {
                let (product, overflow) = bytes.multipliedReportingOverflow(by: d)
                guard !overflow, product <= maxTensorBytes else {
                    throw GemmaANEError(.device, "gemma_ane.mil.serve: reply tensor \(name) of shape \(shape) is too large")
                }
                bytes = product
            }
            out[name] = Tensor(shape: shape, dtype: dtype, bytes: try read(output, bytes, process))
        }
        if let message = reply["error"]?.string {
            let kind = GemmaANEError.Kind(rawValue: reply["kind"]?.string ?? "") ?? .device
            throw GemmaANEError(kind, message)
        }
        return (reply, out)
    }

    private static func read(_ output: FileHandle, _ count: Int, _ process: Process) throws -> Data {
        var data = Data()
        while data.count < count {
            guard let chunk = try? output.read(upToCount: count - data.count), !chunk.isEmpty else { throw died(process) }
            data.append(chunk)
        }
        return data
    }

    private static func died(_ process: Process) -> GemmaANEError {
        // its stdout closed: give it a moment to exit, so the message can say how
        for _ in 0..<50 where process.isRunning { Thread.sleep(forTimeInterval: 0.1) }
        if process.isRunning {
            return GemmaANEError(.device, "gemma_ane.mil.serve: the Python executor stopped answering")
        }
        return GemmaANEError(.device, "gemma_ane.mil.serve: the Python executor exited (status \(process.terminationStatus); its stderr says why)")
    }

    private static func parseChunks(_ value: BundleJSON?) throws -> [Chunk] {
        func specs(_ v: BundleJSON?) throws -> [TensorSpec] {
            try (v?.array ?? []).map { s in
                guard let name = s.object?["name"]?.string, let dtype = s.object?["dtype"]?.string.flatMap(Tensor.DType.init),
                    let shape = s.object?["shape"]?.array?.compactMap(\.int)
                else { throw GemmaANEError(.bundle, "gemma_ane.mil.serve: a tensor of a type this package cannot pass (\(s.short))") }
                return TensorSpec(name: name, shape: shape, dtype: dtype)
            }
        }
        guard let list = value?.array, !list.isEmpty else {
            throw GemmaANEError(.device, "gemma_ane.mil.serve: the hello reply lists no chunks")
        }
        return try list.map { c in
            guard let name = c.object?["name"]?.string, let functions = c.object?["functions"]?.array?.compactMap(\.string),
                let ios = c.object?["interfaces"]?.object
            else { throw GemmaANEError(.device, "gemma_ane.mil.serve: a chunk without name, functions or interfaces") }
            var interfaces: [String: FunctionInterface] = [:]
            for (f, io) in ios {
                interfaces[f] = FunctionInterface(
                    inputs: try specs(io.object?["inputs"]), outputs: try specs(io.object?["outputs"]),
                    states: try specs(io.object?["states"]))
            }
            return Chunk(name: name, functionNames: functions, interfaces: interfaces)
        }
    }
}

/// A chunk run through a PipeClient: the ChunkRunner the engine drives on Linux.
public final class PipeRunner: ChunkRunner {
    final class State: ChunkState {
        let id: Int
        let client: PipeClient
        /// The function that made it: its declared states are this state's shapes.
        let function: String
        init(id: Int, client: PipeClient, function: String) {
            self.id = id
            self.client = client
            self.function = function
        }
        deinit { client.release(id) }
    }

    public let client: PipeClient
    public let name: String
    public let functionNames: [String]
    public let interfaces: [String: FunctionInterface]

    public init(client: PipeClient, chunk: PipeClient.Chunk) {
        self.client = client
        name = chunk.name
        functionNames = chunk.functionNames
        interfaces = chunk.interfaces
    }

    /// One runner per chunk of the bundle directory `bundle`, in order, all on one server.
    public static func open(bundle: URL, python: String) throws -> [PipeRunner] {
        let client = try PipeClient(bundle: bundle, python: python)
        return client.chunks.map { PipeRunner(client: client, chunk: $0) }
    }

    /// One runner per chunk of `bundle`, in order, all on one server.
    public static func open(bundle: ModelBundle, python: String) throws -> [PipeRunner] {
        let client = try PipeClient(packages: bundle.chunkPaths, python: python)
        return client.chunks.map { PipeRunner(client: client, chunk: $0) }
    }

    public func load(_ function: String) throws {
        _ = try client.call(["op": "load", "chunk": name, "function": function])
    }

    public func makeState(_ function: String) throws -> ChunkState? {
        let (reply, _) = try client.call(["op": "make_state", "chunk": name, "function": function])
        return reply["state"]?.int.map { State(id: $0, client: client, function: function) }
    }

    /// Nothing to free: the executor's functions share one copy of the weights, loaded with the package.
    public func release(_ functions: [String]) {}

    private func stateId(_ state: ChunkState?) throws -> Any {
        guard let state else { return NSNull() }
        guard let s = state as? State, s.client === client else {
            throw GemmaANEError(.input, "\(name): a state made by another runner")
        }
        return s.id
    }

    public func predict(_ function: String, inputs: [String: Tensor], state: ChunkState?) throws -> [String: Tensor] {
        guard let io = interfaces[function] else {
            throw GemmaANEError(.input, "\(name): no function '\(function)' (has \(functionNames.joined(separator: ", ")))")
        }
        var tensors: [(String, Tensor)] = []
        for spec in io.inputs {
            guard let t = inputs[spec.name] else { throw GemmaANEError(.input, "\(name).\(function): input \(spec.name) missing") }
            guard t.shape == spec.shape, t.dtype == spec.dtype else {
                throw GemmaANEError(
                    .bundle, "\(name).\(function): input \(spec.name) is \(t.shape) \(t.dtype.rawValue), declared \(spec.shape) \(spec.dtype.rawValue)")
            }
            tensors.append((spec.name, t))
        }
        let header: [String: Any] = ["op": "predict", "chunk": name, "function": function, "state": try stateId(state)]
        return try client.call(header, tensors).1
    }

    public func readState(_ state: ChunkState, name state_name: String) throws -> Tensor {
        let header: [String: Any] = ["op": "read_state", "chunk": name, "state": try stateId(state), "name": state_name]
        guard let t = try client.call(header).1[state_name] else {
            throw GemmaANEError(.device, "gemma_ane.mil.serve: no tensor for state \(state_name)")
        }
        return t
    }

    public func writeState(_ state: ChunkState, name state_name: String, _ tensor: Tensor) throws {
        // the server reads exactly the declared bytes: anything else is refused here, before the stream falls out of step
        guard let made = (state as? State)?.function,
            let spec = interfaces[made]?.states.first(where: { $0.name == state_name }),
            spec.shape == tensor.shape, spec.dtype == tensor.dtype
        else {
            throw GemmaANEError(.input, "\(name): state \(state_name) is not \(tensor.shape) \(tensor.dtype.rawValue)")
        }
        let header: [String: Any] = ["op": "write_state", "chunk": name, "state": try stateId(state), "name": state_name]
        _ = try client.call(header, [(state_name, tensor)])
    }
}
#endif
