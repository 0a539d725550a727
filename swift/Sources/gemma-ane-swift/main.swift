import Foundation
import GemmaANE
import GemmaANECoreML

#if canImport(CoreML)
import CoreML
#else
import CoreMLStandIn
#endif

#if canImport(Glibc)
import Glibc
#endif

/// gemma-ane-swift: the Swift package's example executable. `generate` and `chat` with the Python CLI's names for
/// the options they share. On Linux the chunks run in the Python MIL executor (--python PATH, or GEMMA_ANE_PYTHON,
/// default python3 on PATH); errors are one line and exit status 2, as the Python CLI's.
let usage = """
    usage: gemma-ane-swift generate BUNDLE --prompt TEXT [--system TEXT] [--think] [--raw] [--max-tokens N]
                                  [--temperature T] [--top-k K] [--top-p P] [--min-p P] [--repetition-penalty R]
                                  [--presence-penalty P] [--frequency-penalty P] [--seed S] [--json] [--python PATH]
                                  [--backend auto|coreml|mil] [--compute-units cpu_and_ne|cpu_only|cpu_and_gpu|all]
           gemma-ane-swift chat BUNDLE [--system TEXT] [--think] [--max-tokens N] [sampling options] [--python PATH]
                                  [--backend ...] [--compute-units ...]
    """

struct Arguments {
    var command = ""
    var bundle = ""
    var prompt: String?
    var options = GenerateOptions()
    var sampling: [String: String] = [:]
    var json = false
    var python = ProcessInfo.processInfo.environment["GEMMA_ANE_PYTHON"] ?? "python3"
    /// auto: Core ML where it exists, the MIL executor elsewhere. coreml on Linux runs the Core ML runner through
    /// its stand-in (the same executor underneath), which proves the runner's glue, not Core ML.
    var backend = "auto"
    var computeUnits = "cpu_and_ne"

    static let samplingFlags = [
        "--temperature", "--top-k", "--top-p", "--min-p", "--repetition-penalty", "--presence-penalty",
        "--frequency-penalty", "--seed",
    ]

    init(_ argv: [String]) throws {
        var rest = argv[...]
        func value(_ flag: String) throws -> String {
            guard let v = rest.popFirst() else { throw GemmaANEError(.input, "\(flag): expected a value") }
            return v
        }
        guard let command = rest.popFirst(), ["generate", "chat"].contains(command) else {
            throw GemmaANEError(.input, "expected a command: generate or chat")
        }
        self.command = command
        while let arg = rest.popFirst() {
            switch arg {
            case "--prompt": prompt = try value(arg)
            case "--system": options.system = try value(arg)
            case "--think": options.enableThinking = true
            case "--raw": options.raw = true
            case "--json": json = true
            case "--python": python = try value(arg)
            case "--backend":
                backend = try value(arg)
                guard ["auto", "coreml", "mil"].contains(backend) else {
                    throw GemmaANEError(.input, "--backend \(backend): choose auto, coreml or mil")
                }
            case "--compute-units": computeUnits = try value(arg)
            case "--max-tokens":
                let v = try value(arg)
                guard let n = Int(v), n >= 0 else { throw GemmaANEError(.input, "--max-tokens \(v): expected a non-negative integer") }
                options.maxTokens = n
            case _ where Self.samplingFlags.contains(arg): sampling[arg] = try value(arg)
            case _ where arg.hasPrefix("-"): throw GemmaANEError(.input, "\(arg): no such option")
            default:
                guard bundle.isEmpty else { throw GemmaANEError(.input, "\(arg): one bundle only") }
                bundle = arg
            }
        }
        guard !bundle.isEmpty else { throw GemmaANEError(.input, "BUNDLE: missing") }
        if command == "generate", prompt == nil { throw GemmaANEError(.input, "--prompt: missing") }
    }

    /// The sampling options given, over `base` (the bundle's defaults), each refused naming its flag.
    func samplingOptions(over base: SamplingOptions) throws -> SamplingOptions {
        var s = base
        func number(_ flag: String) throws -> Double? {
            guard let v = sampling[flag] else { return nil }
            guard let d = Double(v), d.isFinite else { throw GemmaANEError(.input, "\(flag) \(v): expected a number") }
            return d
        }
        func integer(_ flag: String) throws -> Int? {
            guard let v = sampling[flag] else { return nil }
            guard let i = Int(v) else { throw GemmaANEError(.input, "\(flag) \(v): expected an integer") }
            return i
        }
        if let t = try number("--temperature") { s.temperature = t }
        if let k = try integer("--top-k") { s.topK = k }
        if let p = try number("--top-p") { s.topP = p }
        if let p = try number("--min-p") { s.minP = p }
        if let r = try number("--repetition-penalty") { s.repetitionPenalty = r }
        if let p = try number("--presence-penalty") { s.presencePenalty = p }
        if let p = try number("--frequency-penalty") { s.frequencyPenalty = p }
        if let v = sampling["--seed"] {
            // a negative seed is its 64-bit two's complement, as the Python sampler maps it
            guard let seed = UInt64(v) ?? Int64(v).map({ UInt64(bitPattern: $0) }) else {
                throw GemmaANEError(.input, "--seed \(v): expected an integer")
            }
            s.seed = seed
        }
        do {
            try s.validate()
        } catch let e as GemmaANEError {
            throw GemmaANEError(.input, "--\(e.message.replacingOccurrences(of: "_", with: "-"))")
        }
        return s
    }
}

func fail(_ message: String) -> Never {
    FileHandle.standardError.write(Data("gemma-ane-swift: error: \(message)\n".utf8))
    exit(2)
}

func write(_ text: String) {
    FileHandle.standardOutput.write(Data(text.utf8))
}

func run() async throws {
    let args = try Arguments(Array(CommandLine.arguments.dropFirst()))
    let warn = { (warning: String) in FileHandle.standardError.write(Data("warning: \(warning)\n".utf8)) }
    let url = URL(fileURLWithPath: args.bundle)
    let units = try MLComputeUnits(named: args.computeUnits)
    let model: GemmaModel
    #if canImport(CoreML)
        let coreML = args.backend != "mil"
    #else
        let coreML = args.backend == "coreml"
        StandInDevice.shared.python = args.python
    #endif
    if coreML {
        model = try await GemmaModel.load(url, computeUnits: units, warn: warn)
    } else {
        model = try GemmaModel.load(url, python: args.python, warn: warn)
    }
    let sampling = try model.sampling(try args.samplingOptions(over: try model.defaultSampling()))
    switch args.command {
    case "generate":
        try generate(model, args, sampling)
    default:
        var options = args.options
        options.sampling = sampling
        try chat(ChatSession(model: model, options: options))
    }
}

func generate(_ model: GemmaModel, _ args: Arguments, _ sampling: SamplingOptions) throws {
    let prompt = args.prompt ?? ""
    let (ids, marks): ([Int], [Int])
    if args.options.raw {
        if args.options.system != nil {
            throw GemmaANEError(.input, "a raw prompt has no chat template, so it cannot take a system prompt or tools")
        }
        (ids, marks) = (model.rawPromptIds(prompt), [])
    } else {
        let system = args.options.system.flatMap { $0.isEmpty ? nil : [ChatMessage.system($0)] } ?? []
        (ids, marks) = try model.promptIds(system + [.user(prompt)], enableThinking: args.options.enableThinking)
    }
    var tokens: [Int] = [], text = "", reasoning = ""
    let stats = try model.generate(ids: ids, marks: marks, maxTokens: args.options.maxTokens, sampling: sampling) { event in
        switch event {
        case .token(let id): tokens.append(id)
        case .text(let piece):
            text += piece
            if !args.json { write(piece) }
        case .reasoning(let piece):
            reasoning += piece
            if !args.json { FileHandle.standardError.write(Data(piece.utf8)) }
        case .toolCall, .finish: break
        }
        return true
    }
    if args.json {
        let object: [String: Any] = [
            "tokens": tokens, "text": text, "reasoning": reasoning, "finish_reason": stats.finishReason, "prompt_tokens": stats.promptTokens,
            "reused_tokens": stats.reusedTokens, "generated_tokens": stats.generatedTokens, "crossings": stats.crossings,
        ]
        write(String(decoding: try JSONSerialization.data(withJSONObject: object, options: [.sortedKeys]), as: UTF8.self) + "\n")
    } else {
        write("\n")
        FileHandle.standardError.write(Data((summary(stats) + "\n").utf8))
    }
}

/// One line of a generation's stats, as the Python CLI prints them.
func summary(_ s: GenerationStats) -> String {
    let n = s.generatedTokens
    let generation = n == 1 ? "1 token" : "\(n) tokens, \(String(format: "%.1f", s.decodeTokensPerSecond)) tok/s"
    return "prompt: \(s.promptTokens) tokens (\(s.reusedTokens) reused), \(String(format: "%.1f", s.prefillTokensPerSecond)) tok/s | generation: \(generation)"
        + s.crossings.map { " | climbed: \($0)" }.joined()
}

/// The Python CLI's chat: one user turn a line of stdin, the answer on stdout, its stats on stderr; /reset,
/// /system TEXT and /think on|off as there. An error is this turn's only, never the chat's.
func chat(_ session: ChatSession) throws {
    while let line = readLine(strippingNewline: true) {
        if line.trimmingCharacters(in: .whitespaces).isEmpty { continue }
        if line == "/reset" {
            session.reset()
            write("(conversation cleared)\n")
            continue
        }
        if line.hasPrefix("/system") {
            let text = line.dropFirst("/system".count).trimmingCharacters(in: .whitespaces)
            session.options.system = text.isEmpty ? nil : text
            session.reset()
            write("(system prompt \(text.isEmpty ? "cleared" : "set"); conversation cleared)\n")
            continue
        }
        if line.hasPrefix("/think") {
            let arg = line.dropFirst("/think".count).trimmingCharacters(in: .whitespaces)
            guard arg == "on" || arg == "off" else {
                write("usage: /think on|off\n")
                continue
            }
            session.options.enableThinking = arg == "on"
            write("(thinking \(arg))\n")
            continue
        }
        do {
            let stats = try session.turn(line) { event in
                switch event {
                case .text(let piece): write(piece)
                case .reasoning(let piece): FileHandle.standardError.write(Data(piece.utf8))
                case .token, .toolCall, .finish: break
                }
                return true
            }
            write("\n")
            FileHandle.standardError.write(Data((summary(stats) + "\n").utf8))
        } catch let e as GemmaANEError where e.kind == .input {
            FileHandle.standardError.write(Data("gemma-ane-swift chat: error: \(e.message)\n".utf8))
        }
    }
}

signal(SIGPIPE, SIG_IGN)
do {
    try await run()
} catch let e as GemmaANEError {
    fail(e.message)
} catch {
    fail("\(error)")
}
